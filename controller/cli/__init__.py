"""The operator commands over the HTTP API (nodes, jobs, qos) and `metalguard creds`."""
