# syntax=docker/dockerfile:1
#
# outbox-relay container image.
#
#   docker build --build-arg VERSION=$(git describe --tags --always) -t outbox-relay .
#   docker run --rm outbox-relay version
#
# The image holds only the static binary; `outbox-relay demo` needs local
# PostgreSQL and nats-server binaries and is not meant to run in it.

ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
# go.mod names the exact Go release; fetch it if this image's Go is older.
ENV GOTOOLCHAIN=auto
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
ARG VERSION=dev
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/outbox-relay ./cmd/outbox-relay \
 && /out/outbox-relay version

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/outbox-relay /outbox-relay
# /metrics, /healthz and /readyz when run with --http-addr :8080
# (OUTBOX_RELAY_HTTP_ADDR=:8080).
EXPOSE 8080
USER nonroot:nonroot
ENTRYPOINT ["/outbox-relay"]
CMD ["run"]
