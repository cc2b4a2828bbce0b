# outbox-relay: common tasks. `make test` is the test command (CI runs it via .ci/run).

GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BIN     := bin/outbox-relay

.PHONY: test build demo fmt-check docker clean

## test: vet everything, then run every test with the race detector.
test:
	$(GO) vet ./... && $(GO) test -race -count=1 -timeout 15m ./...

## build: build the relay binary into bin/.
build:
	$(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/outbox-relay

## demo: start throwaway PostgreSQL and nats-server and show rows flowing.
demo:
	$(GO) run ./cmd/outbox-relay demo

## fmt-check: fail if any Go file is not gofmt-formatted.
fmt-check:
	@out="$$(gofmt -l .)"; \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

## docker: build the container image (needs a Docker engine).
docker:
	docker build --build-arg VERSION=$(VERSION) -t outbox-relay:$(VERSION) .

clean:
	rm -rf bin
