//! Process handling: starting a service's process so that none outlives the supervisor
//! ([`spawner`], [`watchdog`]), what `/proc` says about processes ([`procfs`]), and what
//! a service's processes use ([`usage`]).

pub(crate) mod procfs;
pub(crate) mod spawner;
pub(crate) mod usage;
pub(crate) mod watchdog;
