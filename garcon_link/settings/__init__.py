"""Settings: configuration files, secrets and the keyring of a fleet.

Config describes the rooms below it (roles, dial URLs, limits), so it imports ground, core and
net; nothing below imports it.
"""
