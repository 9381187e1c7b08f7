//! Human-readable rendering of a plan.
