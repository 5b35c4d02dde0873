"""Remote devices over TVM RPC: sessions with deadlines, the tracker and server edgeq starts, latency and
power measurement (``bench``), power readings, and on-device tuning (``tune``)."""
