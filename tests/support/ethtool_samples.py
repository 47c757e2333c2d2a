"""``ethtool -S`` outputs for the netdev collector's tests."""

MLX5 = """\
NIC statistics:
     rx_packets: 1234
     rx_prio3_pause: 70
     rx_prio3_pause_duration: 9000
     rx_prio3_pause_transition: 12
     tx_prio3_pause: 5
     rx_prio4_pause: 30
     rx_pause_ctrl_phy: 100
     tx_pause_ctrl_phy: 5
     rx_discards_phy: 3
"""
"""Shaped like ``ethtool -S`` of a ConnectX NIC with PFC on priority 3 and 4."""

VETH = """\
NIC statistics:
     peer_ifindex: 2
     rx_queue_0_xdp_packets: 0
     rx_queue_0_drops: 0
"""
"""``ethtool -S v0`` of a veth on this machine (ethtool 6.1)."""
