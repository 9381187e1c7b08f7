//! The services a running supervisor looks after now: the plan it started with, plus the
//! instances `pdctl scale` and `pdctl apply` added, less those they removed. An index names
//! one service slot for the supervisor's life (the table, the logs and the command
//! channels use it); a removed service leaves a retired slot behind, which a later service
//! of the same name takes over, so names stay unique and indices never shift.

use crate::plan::Plan;
use crate::supervisor::state_dir::logfile::ServiceLog;
use crate::vocab::Service;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// What a service task can be told to do.
#[derive(Debug)]
pub enum Cmd {
    /// Stop for good (`down`): the timeout overrides the plan's when given.
    Stop {
        timeout: Option<Duration>,
        done: oneshot::Sender<()>,
    },
    /// Stop and start again; `cascade` also restarts its `restart_with` companions.
    Restart { reason: String, cascade: bool },
}

/// One snapshot of the services; changed by copying (rare: an add, a remove, a replace).
#[derive(Debug, Clone)]
pub struct Members {
    /// Every slot's service, retired ones included (`index_of` skips those).
    pub plan: Plan,
    /// Per slot: where its output goes.
    pub logs: Vec<Arc<ServiceLog>>,
    /// Per slot: its task's command channel (closed for remote and retired services).
    pub commands: Vec<mpsc::UnboundedSender<Cmd>>,
    retired: Vec<bool>,
}

impl Members {
    /// The plan as started: every slot live.
    pub fn new(
        plan: Plan,
        logs: Vec<Arc<ServiceLog>>,
        commands: Vec<mpsc::UnboundedSender<Cmd>>,
    ) -> Members {
        let retired = vec![false; plan.services.len()];
        Members {
            plan,
            logs,
            commands,
            retired,
        }
    }

    /// The slot of the live service called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.plan.index_of(name).filter(|&i| !self.retired[i])
    }

    /// The slot a retired service called `name` left, for a new service of that name.
    pub fn retired_slot(&self, name: &str) -> Option<usize> {
        self.plan.index_of(name).filter(|&i| self.retired[i])
    }

    /// Puts `service` in a new slot (or the retired slot of its name); returns the slot.
    pub fn insert(
        &mut self,
        service: Service,
        log: Arc<ServiceLog>,
        commands: mpsc::UnboundedSender<Cmd>,
    ) -> usize {
        match self.retired_slot(&service.name) {
            Some(i) => {
                self.plan.services[i] = service;
                self.logs[i] = log;
                self.commands[i] = commands;
                self.retired[i] = false;
                i
            }
            None => {
                self.plan.services.push(service);
                self.logs.push(log);
                self.commands.push(commands);
                self.retired.push(false);
                self.plan.services.len() - 1
            }
        }
    }

    /// Marks slot `idx` removed.
    pub fn retire(&mut self, idx: usize) {
        self.retired[idx] = true;
    }

    /// The plan of the live services only: what plan.json holds and a later `apply`
    /// compares a changed topology with.
    pub fn live_plan(&self) -> Plan {
        let mut plan = self.plan.clone();
        plan.services = self
            .plan
            .services
            .iter()
            .zip(&self.retired)
            .filter(|(_, retired)| !**retired)
            .map(|(s, _)| s.clone())
            .collect();
        let live = &plan.services;
        plan.settings
            .retain(|name, _| live.iter().any(|s| &s.name == name));
        plan
    }
}
