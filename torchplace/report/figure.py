"""Matplotlib, imported only when a picture is drawn, and :class:`Picture`, what every plot returns.

``import torchplace`` and the CLI never import matplotlib: each drawing function calls
:func:`new_figure`, which imports it then (or raises :class:`MissingDependencyError` naming the
pip command). Figures are made with ``matplotlib.figure.Figure`` directly, not pyplot, so drawing
touches no global state and works on any thread and without a display.
"""
from __future__ import annotations

import io
import itertools
import re
from pathlib import Path
from typing import Any

from torchplace.errors import MissingDependencyError, UsageError

__all__ = ["Picture", "device_colors", "literal", "new_figure", "xml_text"]

_INSTALL = "pip install 'torchplace[report]'"
_SALT = itertools.count()  # each SVG gets its own ids, so several can sit inline in one HTML page
_TAG = re.compile(r"<[^!?][^>]*>")  # a start or end tag: attribute values hold no '>' (matplotlib escapes it)
_ID_OR_REF = re.compile(r'(\sid="|url\(#|href="#)([^")]+)')
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")  # XML 1.0 has no such characters
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")
"""Device colours (Tableau 10), in the order devices first appear in a plan."""


def new_figure(width: float, height: float) -> Any:
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches.

    Raises:
        MissingDependencyError: if matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(f"torchplace's pictures and reports need matplotlib: {_INSTALL}") from e
    return Figure(figsize=(width, height), layout="constrained")


def literal(text: str) -> str:
    """``text`` as matplotlib shows it as it is: a pair of ``$`` would start mathtext (a node named
    ``a$b$`` drawn in italics, ``$\\foo$`` a ValueError from the mathtext parser), so each is escaped;
    a character XML cannot hold becomes U+FFFD (:func:`xml_text`), so the SVG stays well-formed."""
    return xml_text(text).replace("$", r"\$")


def xml_text(text: str) -> str:
    """``text`` with each character XML 1.0 cannot hold (a control character of a workload file's
    name) replaced by U+FFFD: for the pictures' SVG and the report's HTML."""
    return _NOT_XML.sub("\ufffd", text)


def device_colors(devices: Any) -> dict[str, str]:
    """A colour per device name, in the given order (cycling after ten)."""
    return {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(dict.fromkeys(devices))}


class Picture:
    """A drawn figure: shows inline in a notebook (``_repr_png_``, ``_repr_svg_``), saves as PNG,
    SVG or PDF, and gives its bytes.

    Attributes:
        figure: the matplotlib ``Figure`` (to restyle it before saving).
    """

    def __init__(self, figure: Any) -> None:
        self.figure = figure

    def png(self, dpi: int = 100) -> bytes:
        out = io.BytesIO()
        self.figure.savefig(out, format="png", dpi=dpi, metadata={"Software": None})
        return out.getvalue()

    def svg(self) -> str:
        """The figure as an ``<svg>`` element (no XML prolog: it can sit inline in HTML); text is
        text, no URL but its XML namespaces is named, and ids are unique per call: every id, and
        every ``url(#id)`` and ``href="#id"`` naming one, gets a prefix of its own (matplotlib
        numbers ``patch_1``, ``axes_1``, ... afresh in each figure, so two figures in one page
        would share them)."""
        from matplotlib import rc_context

        out = io.StringIO()
        with rc_context({"svg.fonttype": "none"}):  # no RDF metadata, which names matplotlib.org and purl.org
            self.figure.savefig(out, format="svg", metadata=dict.fromkeys(("Date", "Creator", "Format", "Type")))
        text = out.getvalue()
        text = text[text.index("<svg"):]
        prefix = f"tp{next(_SALT)}-"
        # within tags only: a drawn name is text between them, and may read 'id="x"' or 'url(#x)'
        return _TAG.sub(lambda tag: _ID_OR_REF.sub(lambda m: m.group(1) + prefix + m.group(2), tag.group(0)), text)

    def save(self, path: str | Path) -> Path:
        """Write the picture to ``path``; the suffix (``.png``, ``.svg``, ``.pdf``) picks the format.

        Raises:
            UsageError: for another suffix.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".png", ".svg", ".pdf"):
            raise UsageError(f"cannot save a picture as {path.name!r}: use a .png, .svg or .pdf file name")
        if path.is_dir() or not path.parent.is_dir():
            raise UsageError(f"cannot save a picture as {str(path)!r}: give a file name in an existing directory")
        self.figure.savefig(path, format=suffix[1:])
        return path

    def _repr_png_(self) -> bytes:
        return self.png()

    def _repr_svg_(self) -> str:
        return self.svg()

    def __repr__(self) -> str:
        w, h = self.figure.get_size_inches()
        return f"<torchplace Picture {w:.1g}x{h:.1g} in: {self.figure.axes[0].get_title() if self.figure.axes else ''}>"
