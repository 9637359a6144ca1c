"""What the planner is given besides the model: cluster descriptions (``cluster``)."""
