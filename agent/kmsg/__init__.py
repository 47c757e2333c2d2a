"""The kernel log monitor (docs/kmsg.md): /dev/kmsg records parsed, classified by shipped
rules, coalesced into storms and turned into immediate events. Importing the package pulls
in nothing."""
