//! KV connectors: one file each.
