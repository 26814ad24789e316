"""Low-rank compression by power iteration: PowerSGD (centralized) and PowerGossip (decentralized)."""
