// Package composecheck holds only tests. They check the deployment files that
// no Go code compiles, so that a typo there fails `make test` instead of a
// user's `docker compose up`:
//
//   - docker-compose.yml: PostgreSQL with wal_level=logical, NATS with
//     JetStream, migrate before relay, and relay settings that point at the
//     compose services and name flags the binary has;
//   - deploy/nats.conf: parsed by nats-server's own parser, with the compose
//     command line, and started in-process (JetStream with
//     sync_interval: always);
//   - Dockerfile and .dockerignore: a static (CGO_ENABLED=0) build of
//     ./cmd/outbox-relay, run as a non-root user.
//
// No Docker engine is needed.
package composecheck
