"""What a run reports while it trains: DeepSpeed's printed lines (progress), the CSV and
TensorBoard monitor (monitor) and its plot (plot)."""
