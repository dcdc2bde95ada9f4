"""`scripts/gpu-check`: the appliance's GPU paths proved on real NVIDIA hardware (or, on a
machine without one, against the fake pynvml). Test tooling, not part of the appliance
package: it runs the daemon from the checkout as an operator would. See main.py."""
