"""Flow control: queueing, priority bands and fairness while the pool is saturated."""
