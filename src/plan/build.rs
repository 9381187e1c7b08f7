//! Topology -> plan.

/// Inputs to planning besides the topology.
#[derive(Debug, Clone)]
pub struct PlanInput {}

/// A topology that cannot be planned.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// Builds the plan.
pub fn build_plan(_input: &PlanInput) -> Result<super::Plan, PlanError> {
    Err(PlanError("not built yet".into()))
}
