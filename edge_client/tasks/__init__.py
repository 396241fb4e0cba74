"""Task handlers: one per task kind the aggregator can ask for. Each maps task params to a result
(body, tensors) using the device's local data and runtimes."""
