"""Remote devices over TVM RPC: tracker and server helpers, remote sessions, tuning, latency and power.

Planned (see the project's issues); nothing here yet.
"""
