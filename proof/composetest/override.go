// Package composetest supports `make compose-test` (scripts/compose-test.sh),
// which brings docker-compose.yml up on a machine where containers may only
// use the host's network: it writes the compose override that adapts the
// file to that machine, and checks what reached the consumer.
//
// The override is derived from docker-compose.yml, not written by hand, so
// that it changes only what the machine forces and a mistake in the file (a
// wrong URL, a missing dependency) still reaches the test:
//
//   - network_mode: host for every service, and no published ports (a
//     Docker bridge hands out private-range addresses, which must never be a
//     target here);
//   - the loopback address and port each server listens on, so that none
//     clashes with the PostgreSQL and NATS the machine already runs: an
//     environment value that is a URL or address of a compose service
//     (postgres:5432, nats:4222) gets that service's loopback endpoint, and
//     nothing else of it changes;
//   - image sources: stand-ins for the official images, and build args that
//     point the Dockerfiles at local base images and a local module proxy.
//
// Healthchecks, dependencies, restart policies and every other setting stay
// as docker-compose.yml has them.
package composetest

import (
	"bytes"
	"fmt"
	"net"
	"net/url"
	"slices"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// Config says how this machine differs from a user's.
type Config struct {
	// Endpoints maps a service's in-network address (postgres:5432) to the
	// loopback address it listens on here (127.0.0.1:15432).
	Endpoints map[string]string
	// Env and AddArgs add, per service, what makes its server listen on
	// its Endpoints address: environment variables (which must not be set
	// in docker-compose.yml already) and arguments appended to its command.
	Env     map[string]map[string]string
	AddArgs map[string][]string
	// Addrs maps an environment variable that holds a listen address
	// (OUTBOX_RELAY_HTTP_ADDR) to its value here.
	Addrs map[string]string
	// Images replaces a service's image (the official one) by a local
	// stand-in.
	Images map[string]string
	// BuildArgs are added to every service that builds an image.
	BuildArgs map[string]string
}

// Machine is the Config of machines like the development and CI ones:
// PostgreSQL, NATS's client port and the relay's HTTP server on the given
// loopback addresses, on the host's network. Images and build args are the
// caller's.
func Machine(pgAddr, natsAddr, httpAddr string) (Config, error) {
	pgHost, pgPort, err := net.SplitHostPort(pgAddr)
	if err != nil {
		return Config{}, fmt.Errorf("PostgreSQL address %q: %w", pgAddr, err)
	}
	natsHost, natsPort, err := net.SplitHostPort(natsAddr)
	if err != nil {
		return Config{}, fmt.Errorf("NATS address %q: %w", natsAddr, err)
	}
	for _, h := range []string{pgHost, natsHost} {
		if ip := net.ParseIP(h); ip == nil || !ip.IsLoopback() {
			return Config{}, fmt.Errorf("%q is not a loopback address: only loopback may be a target here", h)
		}
	}
	return Config{
		Endpoints: map[string]string{"postgres:5432": pgAddr, "nats:4222": natsAddr},
		// PGPORT is the port of the server and of every client in the
		// container (pg_isready in the healthcheck, psql); the listen
		// address narrows the image's '*' to loopback.
		Env:     map[string]map[string]string{"postgres": {"PGPORT": pgPort}},
		AddArgs: map[string][]string{"postgres": {"-c", "listen_addresses=" + pgHost}, "nats": {"-a", natsHost, "-p", natsPort}},
		Addrs:   map[string]string{"OUTBOX_RELAY_HTTP_ADDR": httpAddr},
		Images:  map[string]string{},
	}, nil
}

// baseFile is the part of docker-compose.yml the override is derived from.
type baseFile struct {
	Services map[string]struct {
		Image       string         `yaml:"image"`
		Build       any            `yaml:"build"`
		Command     []string       `yaml:"command"`
		Environment map[string]any `yaml:"environment"`
		Ports       []any          `yaml:"ports"`
	} `yaml:"services"`
}

// Override returns the compose override for base (the text of
// docker-compose.yml).
func Override(base []byte, cfg Config) ([]byte, error) {
	var f baseFile
	if err := yaml.Unmarshal(base, &f); err != nil {
		return nil, fmt.Errorf("parse docker-compose.yml (environment as a map, command as a list): %w", err)
	}
	if len(f.Services) == 0 {
		return nil, fmt.Errorf("docker-compose.yml has no services")
	}
	for svc := range cfg.Images {
		if _, ok := f.Services[svc]; !ok {
			return nil, fmt.Errorf("stand-in image for %q, which docker-compose.yml does not have", svc)
		}
	}
	names := make([]string, 0, len(f.Services))
	for name := range f.Services {
		names = append(names, name)
	}
	sort.Strings(names)

	services := mapNode()
	for _, name := range names {
		s := f.Services[name]
		out := mapNode()
		add(out, "network_mode", scalar("host"))
		if len(s.Ports) > 0 {
			// Published ports mean nothing on the host's network.
			reset := &yaml.Node{Kind: yaml.SequenceNode, Tag: "!reset", Style: yaml.FlowStyle}
			add(out, "ports", reset)
		}
		if img, ok := cfg.Images[name]; ok {
			add(out, "image", scalar(img))
		}
		if s.Build != nil {
			b := mapNode()
			add(b, "network", scalar("host"))
			if len(cfg.BuildArgs) > 0 {
				add(b, "args", stringMap(cfg.BuildArgs))
			}
			add(out, "build", b)
		}
		if extra := cfg.AddArgs[name]; len(extra) > 0 {
			if len(s.Command) == 0 {
				return nil, fmt.Errorf("service %s: arguments to add (%q) but no command to add them to", name, extra)
			}
			add(out, "command", stringSeq(append(slices.Clone(s.Command), extra...)))
		}
		env := map[string]string{}
		for k, v := range s.Environment {
			val := fmt.Sprint(v)
			if a, ok := cfg.Addrs[k]; ok {
				env[k] = a
				continue
			}
			if nv, changed, err := rewrite(val, cfg.Endpoints); err != nil {
				return nil, fmt.Errorf("service %s: %s: %w", name, k, err)
			} else if changed {
				env[k] = nv
			}
		}
		for k, v := range cfg.Env[name] {
			if _, ok := s.Environment[k]; ok {
				return nil, fmt.Errorf("service %s: docker-compose.yml already sets %s; the override would hide it", name, k)
			}
			env[k] = v
		}
		if len(env) > 0 {
			add(out, "environment", stringMap(env))
		}
		add(services, name, out)
	}
	doc := mapNode()
	add(doc, "services", services)
	var buf bytes.Buffer
	buf.WriteString("# Written by `outbox-compose-test override` from docker-compose.yml: this\n# machine's host networking, loopback endpoints and local images only.\n")
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{doc}}); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// rewrite replaces, in a URL with a host and port, an in-network address
// found in endpoints by its loopback endpoint. Scheme, user, password, path
// and query stay; a value that is not such a URL is left alone.
func rewrite(val string, endpoints map[string]string) (string, bool, error) {
	u, err := url.Parse(val)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return val, false, nil
	}
	port := u.Port()
	if port == "" {
		switch u.Scheme {
		case "postgres", "postgresql":
			port = "5432"
		case "nats":
			port = "4222"
		default:
			return val, false, nil
		}
	}
	to, ok := endpoints[net.JoinHostPort(u.Hostname(), port)]
	if !ok {
		return val, false, nil
	}
	// Only the host and port change: replace them in the text so that the
	// rest (a password with odd characters, the query) keeps its spelling.
	start := strings.Index(val, "://") + len("://")
	end := len(val)
	if i := strings.IndexAny(val[start:], "/?#"); i >= 0 {
		end = start + i
	}
	if at := strings.LastIndex(val[start:end], "@"); at >= 0 {
		start += at + 1
	}
	if val[start:end] != u.Host {
		return "", false, fmt.Errorf("cannot find host %q in %q", u.Host, val)
	}
	return val[:start] + to + val[end:], true, nil
}

func mapNode() *yaml.Node { return &yaml.Node{Kind: yaml.MappingNode} }

func scalar(s string) *yaml.Node {
	return &yaml.Node{Kind: yaml.ScalarNode, Value: s, Style: yaml.DoubleQuotedStyle}
}

func add(m *yaml.Node, k string, v *yaml.Node) {
	m.Content = append(m.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: k}, v)
}

func stringMap(m map[string]string) *yaml.Node {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	n := mapNode()
	for _, k := range keys {
		add(n, k, scalar(m[k]))
	}
	return n
}

func stringSeq(s []string) *yaml.Node {
	n := &yaml.Node{Kind: yaml.SequenceNode}
	for _, v := range s {
		n.Content = append(n.Content, scalar(v))
	}
	return n
}
