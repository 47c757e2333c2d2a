"""Out-of-band BMC sources (SNMP, Redfish, IPMI), the bmc-proxy poller and remediation."""
