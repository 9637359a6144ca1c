"""The cost model: one term per strategy (``terms/``), their sum (``total``), the throughput
model (``throughput``) and the fitted memory coefficients (``coefficients``)."""
