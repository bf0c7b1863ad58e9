"""Watching a run: the log lines, the goodput ledger and its report, TensorBoard, the health
answer and the timeline."""
