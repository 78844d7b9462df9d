"""How cross-replica reductions are carried out: `CrossDeviceOps` and its implementations
(`cross_device_ops`), and `CommunicationOptions` (`communication`). Internal: the public
names are exported from `jaxdist` and `jaxdist.experimental`.
"""
