//! Every `burn-parallel` layout as a strategy of `burn-train`'s `Learner` (work in progress).
