//! The state directory of a cluster: its lock and run record ([`state`]), the per-service
//! log files and their rotation ([`logfile`]), cleaning up after a killed supervisor
//! ([`stale`]), and finding which cluster a command means ([`select`]).

pub(crate) mod logfile;
pub mod select;
pub(crate) mod stale;
pub(crate) mod state;
