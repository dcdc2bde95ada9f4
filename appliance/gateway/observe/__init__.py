"""What monitoring and people see: probes, Prometheus metrics and the status page."""
