//! The running side: the supervisor process itself and what it does while a cluster is up.
//!
//! - [`runner`]: the supervisor's main loop (start-up, signals, `down` requests, the stop waves);
//! - [`service`]: one task per local service, with its dependency waiting and its run
//!   watching (readiness, liveness, exits) as children;
//! - [`policy`], [`stop`]: when to restart, and how a service is stopped;
//! - [`remote`], [`probe`]: services on other nodes followed by probes, and the probes themselves;
//!   [`crate::stall_clock`]: whether this process was frozen while a probe waited (then it does not count);
//! - [`control_server`]: the socket `status`, `restart` and `down` talk to; [`control_tcp`]:
//!   the same requests from other nodes' supervisors, behind the cluster's secret;
//!   [`peers`]: the other nodes' supervisors, polled for their services' state;
//!   [`ops_hook`]: where changes to the whole cluster are handed to `crate::ops`;
//! - [`table`]: the shared per-service state they all write and `status` reads;
//! - [`members`]: which services run now (the plan, plus what `scale` and `apply` changed);
//! - [`pump`], [`console`], [`progress`]: moving each service's output to its log and the
//!   terminal, and the start-up progress a person sees in the foreground.

pub(crate) mod console;
pub(crate) mod control_server;
pub(crate) mod control_tcp;
pub(crate) mod members;
pub(crate) mod ops_hook;
pub(crate) mod peers;
pub(crate) mod policy;
pub(crate) mod probe;
pub(crate) mod progress;
pub(crate) mod pump;
pub(crate) mod remote;
pub(crate) mod runner;
pub(crate) mod service;
pub(crate) mod stop;
pub(crate) mod table;
