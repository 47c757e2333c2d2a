"""Provisioning: base images, tenant volumes, NBD exports and instances (docs/provisioning.md).

Storage (``images``, ``volumes``, ``exports``, ``storage``: qemu-img and one
qemu-storage-daemon) and the service (``machine``, ``spec``, ``store``, ``bootserver``,
``manager``) live side by side; this package imports none of them itself.
"""
