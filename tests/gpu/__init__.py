"""The GPU tier: tests marked `gpu` (one CUDA device) or `multigpu` (two or more); they skip elsewhere."""
