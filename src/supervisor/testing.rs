//! Plans and services for the supervisor's unit tests, so that each test writes only the
//! fields it is about.

use crate::plan::Plan;
use crate::vocab::{Probe, Role, Service};
use std::collections::BTreeMap;

/// A prefill service `name` on `node` (at 127.0.0.1) that runs `true`, opens no ports and
/// is ready at its first log line.
pub(crate) fn service(name: &str, node: &str) -> Service {
    Service {
        startup_timeout_s: 5,
        ..Service::new(name, Role::Prefill, node, ["true"])
    }
}

/// A service that is ready once its `http` port on 127.0.0.1 takes connections.
pub(crate) fn tcp_service(name: &str, node: &str, port: u16) -> Service {
    Service {
        ports: BTreeMap::from([("http".to_string(), port)]),
        probe: Probe::Tcp {
            host: "127.0.0.1".into(),
            port,
        },
        ..service(name, node)
    }
}

/// Cluster `c` of sim engines with the example connector, its state under /tmp/c, headed
/// by node `head`.
pub(crate) fn plan(head: &str, services: Vec<Service>) -> Plan {
    Plan {
        state_dir: "/tmp/c".into(),
        engine: "sim".into(),
        vllm_version: None,
        connector: "example".into(),
        protocol: "two-step".into(),
        ..Plan::for_tests(head, services)
    }
}
