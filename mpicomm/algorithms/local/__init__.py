"""Local-update methods: several local steps between communications (PD-SGDM, CPD-SGDM, DiLoCo, SparseLoCo,
decentralized DiLoCo, streaming DiLoCo)."""
