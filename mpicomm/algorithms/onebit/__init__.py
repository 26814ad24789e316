"""The 1-bit Adam family: an Adam or LAMB warm-up, then error-compensated 1-bit averaged momentum
(APMSqueeze, 0/1 Adam, 1-bit LAMB)."""
