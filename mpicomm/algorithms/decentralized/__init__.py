"""Decentralized methods: every rank mixes its model with its neighbours' (D-PSGD, D², AD-PSGD, CHOCO, DCD)."""
