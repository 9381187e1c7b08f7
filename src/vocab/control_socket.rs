//! Where a node's supervisor listens. Lives in `vocab` because the planner writes the
//! path into the proxy's settings, the supervisor binds it and every client connects to
//! it.

/// Socket file name inside a cluster's state dir.
pub const SOCKET_NAME: &str = "control.sock";
