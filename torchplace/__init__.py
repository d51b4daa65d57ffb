"""torchplace: decide where every part of a model runs, prove how good that is, and run it there."""
