//! The batch plan: which rows each expert serves, and the waves of experts
//! that fit the slot pool at once.
//!
//! Each distinct expert of the batch ("batch union") becomes one
//! [`ExpertJob`] that is loaded once and run on all its rows. Jobs are ordered
//! by expert id (deterministic, and the order an SSD-sequential layout reads
//! best) and cut into waves of at most `wave_capacity` experts.

use super::{MoeError, Routes};
use std::ops::Range;

/// One expert's work in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertJob {
    /// The routed expert id.
    pub expert: u32,
    /// The batch rows routed to it, ascending.
    pub rows: Vec<u32>,
    /// For each row, the rank (position in that row's top-k) it holds.
    pub ranks: Vec<u32>,
}

/// Routes plus the jobs derived from them, cut into waves.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPlan {
    routes: Routes,
    jobs: Vec<ExpertJob>,
    waves: Vec<Range<usize>>,
}

impl BatchPlan {
    /// Plans `routes` for a pool that can hold `wave_capacity` experts of a
    /// layer at once. Ids are re-checked against `n_experts`.
    pub fn new(routes: Routes, n_experts: u32, wave_capacity: usize) -> Result<Self, MoeError> {
        if wave_capacity == 0 {
            return Err(MoeError::EmptyWave);
        }
        let mut by_expert: Vec<Option<ExpertJob>> = Vec::new();
        for row in 0..routes.rows() {
            let ids = routes.ids(row);
            for (rank, &expert) in ids.iter().enumerate() {
                if expert >= n_experts {
                    return Err(MoeError::ExpertOutOfRange {
                        row,
                        rank,
                        expert,
                        n_experts,
                    });
                }
                if ids[..rank].contains(&expert) {
                    return Err(MoeError::DuplicateExpert { row, expert });
                }
                let e = expert as usize;
                if by_expert.len() <= e {
                    by_expert.resize(e + 1, None);
                }
                let job = by_expert[e].get_or_insert_with(|| ExpertJob {
                    expert,
                    rows: Vec::new(),
                    ranks: Vec::new(),
                });
                job.rows.push(row as u32);
                job.ranks.push(rank as u32);
            }
        }
        let jobs: Vec<ExpertJob> = by_expert.into_iter().flatten().collect();
        let waves = (0..jobs.len())
            .step_by(wave_capacity)
            .map(|start| start..(start + wave_capacity).min(jobs.len()))
            .collect();
        Ok(Self {
            routes,
            jobs,
            waves,
        })
    }

    /// The routes the plan was made from.
    pub fn routes(&self) -> &Routes {
        &self.routes
    }

    /// All jobs, by ascending expert id.
    pub fn jobs(&self) -> &[ExpertJob] {
        &self.jobs
    }

    /// The waves, in order; each is a non-empty slice of [`BatchPlan::jobs`].
    pub fn waves(&self) -> impl ExactSizeIterator<Item = &[ExpertJob]> {
        self.waves.iter().map(|r| &self.jobs[r.clone()])
    }

    /// Number of waves.
    pub fn wave_count(&self) -> usize {
        self.waves.len()
    }
}
