//! The supervisor: runs a plan's services, probes them, restarts them, stops them.

pub mod cli;
