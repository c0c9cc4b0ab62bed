"""The driver of a run: the controller and its colocated twin, the pipeline builder, the preflight, run checkpoints
and global restarts, fault injection, the run's result, the HF export of a run's checkpoints and the warm-up."""
