//! keyway's pure core: resource types, loading, validation, the index and the resolver.
//!
//! Nothing here does I/O or knows about tokio: callers hand in file contents and the current time,
//! and get back objects, errors, a [`plan::Plan`] for the data plane and the status of every object.
//! That keeps every semantic rule testable with plain table tests.

pub mod address;
pub mod conditions;
pub mod destinations;
pub mod gateway;
pub mod httproute;
pub mod index;
pub mod load;
pub mod offline;
pub mod plan;
pub mod port_owners;
pub mod reconcile;
pub mod report;
pub mod resource;
pub mod service_network;
pub mod skupper;
pub mod tls;
pub mod validate;
pub mod yaml;

pub use index::Index;
pub use load::{ConfigError, FileLoad, LoadedObject, Origin, load_file};
pub use plan::Plan;
pub use reconcile::{ObjectState, Reconciled, reconcile};
pub use resource::{Kind, ObjectKey, Resource};

/// Re-exported so callers stamp times with the same type the core uses.
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
pub use k8s_openapi::jiff;
