//! Finding the programs a plan runs.
