import sys

try:
    from torchplace.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: the same one line as later
    print("torchplace: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
