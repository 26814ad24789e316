"""Centralized methods: every rank applies one averaged (or decoded) gradient (AllReduce-SGD, compressed SGD,
Adam, LAMB, HSQ)."""
