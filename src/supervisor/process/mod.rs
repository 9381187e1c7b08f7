//! Process handling: starting a service's process so that none outlives the supervisor
//! ([`spawner`], [`watchdog`]), and what `/proc` says about processes ([`procfs`]).

pub(crate) mod procfs;
pub(crate) mod spawner;
pub(crate) mod watchdog;
