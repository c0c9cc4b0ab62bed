"""What a run reports: the metrics file, live progress, the closing summary, the plots and the memory footprint."""
