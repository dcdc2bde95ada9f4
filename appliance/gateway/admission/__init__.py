"""Admission: which model a request names, which engine takes it, who waits and who is refused
(heat, rate limits, fallback, owners)."""
