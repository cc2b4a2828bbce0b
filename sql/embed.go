// Package sql holds the relay's schema as numbered migration files, embedded
// into the binary. The files are text/template sources: identifiers that come
// from configuration (the outbox table's schema and name) are substituted
// already quoted, so a table named "Order Events" or a schema with a dash
// works and cannot inject SQL. They are applied by internal/schema.Migrate.
package sql

import "embed"

// Migrations holds migrations/NNNN_name.sql, applied in name order.
//
//go:embed migrations/*.sql
var Migrations embed.FS

// Roles is the least-privilege role script (a template like the
// migrations), printed by `outbox-relay migrate --print-grants`.
//
//go:embed roles.sql
var Roles string
