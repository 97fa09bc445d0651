//! [`DeviceMesh`]: the world arranged as an N-dimensional grid of named dimensions
//! (`pp`, `dp`, `fsdp`, `cp`, `tp`, `ep`, ...), with one sub-group per dimension.
//!
//! Ranks are laid out row-major: the last dimension varies fastest, so with
//! `[("dp", 2), ("tp", 2)]` ranks 0 and 1 form a tensor-parallel pair (keep the dimension
//! with the most traffic last, where neighbouring ranks share a node).

use crate::error::CollectiveError;
use crate::group::ProcessGroup;

/// Errors building or querying a mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The product of the dimension sizes is not the world size.
    #[error(
        "mesh {dims} has {product} ranks but the world has {world}; make the product of the \
         dimension sizes equal the number of launched ranks"
    )]
    SizeMismatch {
        /// The requested dimensions, printed.
        dims: String,
        /// Their product.
        product: usize,
        /// The world size.
        world: usize,
    },
    /// A dimension has size 0 or its name is used twice or empty.
    #[error("invalid mesh dimension {name:?}: {reason}")]
    InvalidDim {
        /// The dimension name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A query named a dimension the mesh does not have.
    #[error("the mesh has no dimension {name:?}; its dimensions are {available:?}")]
    UnknownDim {
        /// The requested name.
        name: String,
        /// The names the mesh has.
        available: Vec<String>,
    },
    /// Creating a sub-group failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
}

/// The world as a grid of named dimensions, with the calling rank's coordinates and the
/// sub-group along each dimension.
///
/// # Example
/// ```
/// use burn_parallel::{DeviceMesh, run_local};
///
/// run_local(4, |world| {
///     let mesh = DeviceMesh::new(&world, &[("dp", 2), ("tp", 2)]).unwrap();
///     let tp = mesh.group("tp").unwrap();
///     assert_eq!(tp.size(), 2);
///     assert_eq!(mesh.coord("dp").unwrap(), world.rank() / 2);
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    names: Vec<String>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    world: ProcessGroup,
    groups: Vec<ProcessGroup>,
}

impl DeviceMesh {
    /// Arranges `world` as a grid with the given `(name, size)` dimensions, outermost first,
    /// and creates this rank's sub-group along each dimension (no communication).
    ///
    /// # Errors
    /// [`MeshError::SizeMismatch`] when the product of the sizes is not the world size;
    /// [`MeshError::InvalidDim`] for a zero size or a repeated or empty name.
    pub fn new(world: &ProcessGroup, dims: &[(&str, usize)]) -> Result<Self, MeshError> {
        let mut names: Vec<String> = Vec::with_capacity(dims.len());
        for &(name, size) in dims {
            let reason = if name.is_empty() {
                Some("the name is empty")
            } else if names.iter().any(|n| n == name) {
                Some("the name is used twice")
            } else if size == 0 {
                Some("the size is 0")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(MeshError::InvalidDim {
                    name: name.into(),
                    reason: reason.into(),
                });
            }
            names.push(name.to_string());
        }
        let sizes: Vec<usize> = dims.iter().map(|d| d.1).collect();
        let product: usize = sizes.iter().product();
        if product != world.size() {
            return Err(MeshError::SizeMismatch {
                dims: format!("{dims:?}"),
                product,
                world: world.size(),
            });
        }
        let coords = unravel(world.rank(), &sizes);
        let mut mesh = DeviceMesh {
            names,
            sizes,
            coords,
            world: world.clone(),
            groups: Vec::new(),
        };
        for d in 0..dims.len() {
            let group = mesh.build_group(&[d])?;
            mesh.groups.push(group);
        }
        Ok(mesh)
    }

    fn index(&self, name: &str) -> Result<usize, MeshError> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| MeshError::UnknownDim {
                name: name.into(),
                available: self.names.clone(),
            })
    }

    /// Ranks of the world that share this rank's coordinates except along `dims`, ordered
    /// row-major over `dims`.
    fn build_group(&self, dims: &[usize]) -> Result<ProcessGroup, MeshError> {
        let sub_sizes: Vec<usize> = dims.iter().map(|&d| self.sizes[d]).collect();
        let count: usize = sub_sizes.iter().product();
        let members: Vec<usize> = (0..count)
            .map(|i| {
                let sub = unravel(i, &sub_sizes);
                let mut coords = self.coords.clone();
                for (k, &d) in dims.iter().enumerate() {
                    coords[d] = sub[k];
                }
                ravel(&coords, &self.sizes)
            })
            .collect();
        let group = self.world.split(&members)?;
        // The flight recorder's diagnoses name the group by its dimensions (`tp`, `dp_shard x cp`).
        if let Some(flight) = group.flight() {
            let name: Vec<&str> = dims.iter().map(|&d| self.names[d].as_str()).collect();
            flight.name_group(group.flight_id(), &name.join(" x "));
        }
        Ok(group)
    }

    /// The sub-group along dimension `name` (this rank's coordinates fixed elsewhere).
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`].
    pub fn group(&self, name: &str) -> Result<&ProcessGroup, MeshError> {
        Ok(&self.groups[self.index(name)?])
    }

    /// The sub-group of the ranks whose coordinates satisfy `member(coords)`, in global-rank
    /// order (the row-major order of [`Self::flattened`]). Every member must create it, in the
    /// same order relative to their other groups.
    fn group_where(&self, member: impl Fn(&[usize]) -> bool) -> Result<ProcessGroup, MeshError> {
        let count: usize = self.sizes.iter().product();
        let members: Vec<usize> = (0..count)
            .filter(|&r| member(&unravel(r, &self.sizes)))
            .collect();
        Ok(self.world.split(&members)?)
    }

    /// A new sub-group spanning several dimensions flattened together (for example
    /// `["dp", "cp"]` for the gradient reduction of context parallelism). Every member must
    /// create it, in the same order relative to their other groups.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`].
    pub fn flattened(&self, names: &[&str]) -> Result<ProcessGroup, MeshError> {
        let dims = names
            .iter()
            .map(|n| self.index(n))
            .collect::<Result<Vec<_>, _>>()?;
        self.build_group(&dims)
    }

    /// This rank's coordinate along `name`.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`].
    pub fn coord(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.coords[self.index(name)?])
    }

    /// The size of dimension `name`, 1 when the mesh does not have it (a dimension that is not
    /// there is not parallelised).
    pub fn size_or_one(&self, name: &str) -> usize {
        self.index(name).map(|i| self.sizes[i]).unwrap_or(1)
    }

    /// This rank's coordinates, outermost dimension first.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// Dimension names, outermost first.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Dimension sizes, outermost first.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The whole world.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }
}

fn unravel(mut index: usize, sizes: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; sizes.len()];
    for d in (0..sizes.len()).rev() {
        coords[d] = index % sizes[d];
        index /= sizes[d];
    }
    coords
}

fn ravel(coords: &[usize], sizes: &[usize]) -> usize {
    coords.iter().zip(sizes).fold(0, |acc, (c, s)| acc * s + c)
}

/// The parallel dimensions of a training job, torchtitan's `ParallelDims`: pipeline stages
/// (`pp`, each rank group holds some layers), data-parallel replicas (`dp_replicate`, DDP or the replicate dimension of HSDP), data-parallel shards
/// (`dp_shard`, ZeRO/FSDP), context parallelism (`cp`, each sequence split over the ranks) and
/// tensor parallelism (`tp`), outermost first. [`Self::build`] checks the product against the
/// world size and makes the mesh `[pp, dp_replicate, dp_shard, cp, tp]`, so the tensor-parallel
/// ranks are neighbours and the pipeline, whose traffic is the lightest (one activation per
/// micro-batch and boundary), spans the farthest ranks. Every data-parallel group lies inside
/// one pipeline coordinate: each pipeline rank reduces its stages' gradients with its own
/// replicas.
///
/// Context-parallel ranks see the same rows but different tokens, so they reduce gradients like
/// data ranks: [`Self::gradient_reduction`] flattens `dp_replicate x dp_shard x cp` and
/// [`Self::shard_with_cp`] flattens `dp_shard x cp` (what FSDP shards over, as torchtitan does).
///
/// Expert parallelism (`ep`) adds no ranks: as in torchtitan, the `ep` ranks are carved out of
/// the data-parallel ranks. Number the data-parallel ranks `d = replicate * dp_shard + shard`;
/// the expert-parallel group ([`Self::expert_parallel`]) is a block of `ep` consecutive `d` (same
/// `cp` and `tp` coordinates), each member holding `E / ep` of the experts; the ranks holding the
/// same experts ([`Self::expert_data_parallel`]: same `d % ep`, every `d / ep` and every `cp`
/// coordinate) reduce the expert gradients, every other parameter is reduced over
/// [`Self::gradient_reduction`]. `ep` must divide `dp_replicate x dp_shard`.
///
/// # Example
/// ```
/// use burn_parallel::{ParallelDims, run_local};
///
/// run_local(8, |world| {
///     let dims = ParallelDims { dp_shard: 2, cp: 2, tp: 2, ..ParallelDims::default() };
///     let mesh = dims.build(&world).unwrap();
///     assert_eq!(mesh.group("tp").unwrap().size(), 2);
///     assert_eq!(mesh.group("cp").unwrap().size(), 2);
///     assert_eq!(dims.data_parallel(&mesh).unwrap().size(), 2); // replicate x shard
///     assert_eq!(dims.gradient_reduction(&mesh).unwrap().size(), 4); // ... x cp
///     Ok(())
/// })
/// .unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParallelDims {
    /// Pipeline ranks (pipeline parallelism): each holds some of the model's stages.
    #[serde(default = "one")]
    pub pp: usize,
    /// Replicas of the whole model (or of each shard group under HSDP).
    pub dp_replicate: usize,
    /// Ranks that shard parameters, gradients and optimizer state among them.
    pub dp_shard: usize,
    /// Ranks that split each sequence (context parallelism).
    #[serde(default = "one")]
    pub cp: usize,
    /// Ranks that split each layer (tensor parallelism).
    pub tp: usize,
    /// Ranks that split the experts of each mixture-of-experts layer, carved out of the
    /// data-parallel ranks (1: every rank holds every expert).
    #[serde(default = "one")]
    pub ep: usize,
}

impl Default for ParallelDims {
    fn default() -> Self {
        Self {
            pp: 1,
            dp_replicate: 1,
            dp_shard: 1,
            cp: 1,
            tp: 1,
            ep: 1,
        }
    }
}

fn one() -> usize {
    1
}

impl ParallelDims {
    /// The number of ranks these dimensions need.
    pub fn world_size(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
    }

    /// The mesh `[("pp", ..), ("dp_replicate", ..), ("dp_shard", ..), ("cp", ..), ("tp", ..)]`
    /// over `world`.
    ///
    /// ```
    /// use burn_parallel::{ParallelDims, run_local};
    ///
    /// run_local(8, |world| {
    ///     let dims = ParallelDims { pp: 2, dp_replicate: 2, tp: 2, ..ParallelDims::default() };
    ///     let mesh = dims.build(&world).unwrap();
    ///     // The pipeline is outermost: ranks r and r + 4 are consecutive pipeline ranks.
    ///     assert_eq!(mesh.group("pp").unwrap().members(), &[world.rank() % 4, world.rank() % 4 + 4]);
    ///     // Data parallelism stays inside one pipeline coordinate.
    ///     let dp = dims.data_parallel(&mesh).unwrap();
    ///     assert!(dp.members().iter().all(|r| r / 4 == world.rank() / 4));
    ///     // So do the expert-parallel groups carved out of it.
    ///     let dims = ParallelDims { ep: 2, ..dims };
    ///     let mesh = dims.build(&world).unwrap();
    ///     let (base, t) = (world.rank() / 4 * 4, world.rank() % 2);
    ///     assert_eq!(dims.expert_parallel(&mesh).unwrap().members(), &[base + t, base + 2 + t]);
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    ///
    /// # Errors
    /// [`MeshError::SizeMismatch`] when the product is not the world size;
    /// [`MeshError::InvalidDim`] for a zero size, or an `ep` that does not divide
    /// `dp_replicate x dp_shard`.
    pub fn build(&self, world: &ProcessGroup) -> Result<DeviceMesh, MeshError> {
        let dp = self.dp_replicate * self.dp_shard;
        if self.ep == 0 || (dp > 0 && !dp.is_multiple_of(self.ep)) {
            return Err(MeshError::InvalidDim {
                name: "ep".into(),
                reason: format!(
                    "the expert-parallel size {} must be positive and divide the {dp} \
                     data-parallel ranks (dp_replicate {} x dp_shard {}): expert-parallel ranks \
                     are carved out of them",
                    self.ep, self.dp_replicate, self.dp_shard
                ),
            });
        }
        DeviceMesh::new(
            world,
            &[
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
            ],
        )
    }

    /// The whole data-parallel group (`dp_replicate x dp_shard` flattened): the ranks that see
    /// different data and average their gradients. A new group: every rank must create it.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`] for a mesh not built by [`Self::build`].
    pub fn data_parallel(&self, mesh: &DeviceMesh) -> Result<ProcessGroup, MeshError> {
        mesh.flattened(&["dp_replicate", "dp_shard"])
    }

    /// The ranks that reduce (average) gradients together: `dp_replicate x dp_shard x cp`
    /// flattened (context-parallel ranks hold other tokens of the same rows, so their gradients
    /// add up like those of data ranks). Equals [`Self::data_parallel`] without context
    /// parallelism. A new group: every rank must create it.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`] for a mesh not built by [`Self::build`].
    pub fn gradient_reduction(&self, mesh: &DeviceMesh) -> Result<ProcessGroup, MeshError> {
        mesh.flattened(&["dp_replicate", "dp_shard", "cp"])
    }

    /// The ranks FSDP (or ZeRO) shards over under context parallelism: `dp_shard x cp`
    /// flattened (torchtitan's `dp_shard_cp`). A new group: every rank must create it.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`] for a mesh not built by [`Self::build`].
    pub fn shard_with_cp(&self, mesh: &DeviceMesh) -> Result<ProcessGroup, MeshError> {
        mesh.flattened(&["dp_shard", "cp"])
    }

    /// This rank's index among the data-parallel ranks, `replicate * dp_shard + shard`, from
    /// mesh coordinates `[pp, dp_replicate, dp_shard, cp, tp]`.
    fn dp_index(&self, coords: &[usize]) -> usize {
        coords[1] * self.dp_shard + coords[2]
    }

    /// The expert-parallel group: `ep` consecutive data-parallel ranks (same `pp`, `cp` and `tp`
    /// coordinates) that split the experts among them and exchange tokens (all-to-all). A new
    /// group: every rank must create it.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`] for a mesh not built by [`Self::build`]; collective errors.
    ///
    /// # Example
    /// ```
    /// use burn_parallel::{ParallelDims, run_local};
    ///
    /// run_local(4, |world| {
    ///     let dims = ParallelDims { dp_replicate: 4, ep: 2, ..ParallelDims::default() };
    ///     let mesh = dims.build(&world).unwrap();
    ///     let ep = dims.expert_parallel(&mesh).unwrap();
    ///     let edp = dims.expert_data_parallel(&mesh).unwrap();
    ///     assert_eq!(ep.members(), if world.rank() < 2 { &[0, 1] } else { &[2, 3] });
    ///     assert_eq!(edp.members(), if world.rank() % 2 == 0 { &[0, 2] } else { &[1, 3] });
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn expert_parallel(&self, mesh: &DeviceMesh) -> Result<ProcessGroup, MeshError> {
        self.check_mesh(mesh)?;
        let me = mesh.coords().to_vec();
        let block = self.dp_index(&me) / self.ep;
        mesh.group_where(|c| {
            c[0] == me[0] && c[3] == me[3] && c[4] == me[4] && self.dp_index(c) / self.ep == block
        })
    }

    /// The ranks that hold the same experts (same position in their expert-parallel group, any
    /// `cp` coordinate, same `pp` and `tp` coordinates): expert gradients are reduced over this group
    /// only. A new group: every rank must create it.
    ///
    /// # Errors
    /// [`MeshError::UnknownDim`] for a mesh not built by [`Self::build`]; collective errors.
    pub fn expert_data_parallel(&self, mesh: &DeviceMesh) -> Result<ProcessGroup, MeshError> {
        self.check_mesh(mesh)?;
        let me = mesh.coords().to_vec();
        let slot = self.dp_index(&me) % self.ep;
        mesh.group_where(|c| c[0] == me[0] && c[4] == me[4] && self.dp_index(c) % self.ep == slot)
    }

    /// Checks that `mesh` has the dimensions [`Self::build`] makes.
    fn check_mesh(&self, mesh: &DeviceMesh) -> Result<(), MeshError> {
        let expected = ["pp", "dp_replicate", "dp_shard", "cp", "tp"];
        if mesh.names().len() != expected.len() {
            return Err(MeshError::UnknownDim {
                name: expected.join(", "),
                available: mesh.names().to_vec(),
            });
        }
        for name in expected {
            mesh.coord(name)?;
        }
        Ok(())
    }
}
