package composecheck

import (
	"bufio"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/conf"
	"github.com/nats-io/nats-server/v2/server"
	"gopkg.in/yaml.v3"
)

// root is the module root, relative to this package's directory (where go
// test runs the test binary).
const root = "../.."

// compose is the part of docker-compose.yml the checks read. Fields that take
// several forms in the Compose spec (short and long syntax) stay untyped and
// are read by the helpers below.
type compose struct {
	Services map[string]service `yaml:"services"`
	Volumes  map[string]any     `yaml:"volumes"`
}

type service struct {
	Image       string       `yaml:"image"`
	Build       any          `yaml:"build"`
	Command     any          `yaml:"command"`
	Environment any          `yaml:"environment"`
	DependsOn   any          `yaml:"depends_on"`
	Ports       []any        `yaml:"ports"`
	Volumes     []any        `yaml:"volumes"`
	Healthcheck *healthcheck `yaml:"healthcheck"`
	Restart     string       `yaml:"restart"`
}

type healthcheck struct {
	Test any `yaml:"test"`
}

func loadCompose(t *testing.T) compose {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docker-compose.yml"))
	if err != nil {
		t.Fatalf("read docker-compose.yml: %v", err)
	}
	var c compose
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("parse docker-compose.yml: %v", err)
	}
	if len(c.Services) == 0 {
		t.Fatal("docker-compose.yml has no services")
	}
	return c
}

func mustService(t *testing.T, c compose, name string) service {
	t.Helper()
	s, ok := c.Services[name]
	if !ok {
		t.Fatalf("docker-compose.yml: no service %q", name)
	}
	return s
}

// stringList reads a field that is either a string (split like a shell would
// for simple words) or a list of scalars.
func stringList(t *testing.T, what string, v any) []string {
	t.Helper()
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		return strings.Fields(v)
	case []any:
		out := make([]string, 0, len(v))
		for _, e := range v {
			switch e.(type) {
			case string, int, float64, bool:
				out = append(out, fmt.Sprint(e))
			default:
				t.Fatalf("%s: element %v is a %T, want a scalar", what, e, e)
			}
		}
		return out
	default:
		t.Fatalf("%s: %T, want a string or a list", what, v)
		return nil
	}
}

// envMap reads environment: either a map or a list of KEY=VALUE.
func envMap(t *testing.T, what string, v any) map[string]string {
	t.Helper()
	out := map[string]string{}
	switch v := v.(type) {
	case nil:
	case map[string]any:
		for k, val := range v {
			if val == nil {
				out[k] = ""
				continue
			}
			out[k] = fmt.Sprint(val)
		}
	case []any:
		for _, kv := range stringList(t, what, v) {
			k, val, _ := strings.Cut(kv, "=")
			out[k] = val
		}
	default:
		t.Fatalf("%s: environment is a %T, want a map or a list", what, v)
	}
	return out
}

// dependsOn reads depends_on into service -> condition. The short (list)
// syntax means service_started.
func dependsOn(t *testing.T, what string, v any) map[string]string {
	t.Helper()
	out := map[string]string{}
	switch v := v.(type) {
	case nil:
	case []any:
		for _, s := range stringList(t, what, v) {
			out[s] = "service_started"
		}
	case map[string]any:
		for name, spec := range v {
			cond := "service_started"
			if m, ok := spec.(map[string]any); ok {
				if c, ok := m["condition"].(string); ok {
					cond = c
				}
			}
			out[name] = cond
		}
	default:
		t.Fatalf("%s: depends_on is a %T, want a map or a list", what, v)
	}
	return out
}

// containerPorts returns the container side of ports entries.
func containerPorts(t *testing.T, what string, ports []any) []int {
	t.Helper()
	var out []int
	for _, p := range ports {
		var s string
		switch p := p.(type) {
		case string:
			// [host_ip:][host:]container[/proto]; host may be ${VAR:-default}.
			s = p[strings.LastIndex(p, ":")+1:]
		case int:
			s = strconv.Itoa(p)
		case map[string]any:
			s = fmt.Sprint(p["target"])
		default:
			t.Fatalf("%s: port %v is a %T", what, p, p)
		}
		s, _, _ = strings.Cut(s, "/")
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatalf("%s: port %v: container port %q is not a number", what, p, s)
		}
		out = append(out, n)
	}
	return out
}

// mounts returns target -> source of short-syntax volume entries.
func mounts(t *testing.T, what string, vols []any) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, v := range vols {
		switch v := v.(type) {
		case string:
			parts := strings.Split(v, ":")
			if len(parts) < 2 {
				continue // anonymous volume
			}
			out[parts[1]] = parts[0]
		case map[string]any:
			out[fmt.Sprint(v["target"])] = fmt.Sprint(v["source"])
		default:
			t.Fatalf("%s: volume %v is a %T", what, v, v)
		}
	}
	return out
}

// flagValue returns the argument after the first of names in args.
func flagValue(args []string, names ...string) (string, bool) {
	for i, a := range args {
		for _, n := range names {
			if a == n && i+1 < len(args) {
				return args[i+1], true
			}
			if v, ok := strings.CutPrefix(a, n+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

func TestServicesAndReferences(t *testing.T) {
	c := loadCompose(t)
	for _, name := range []string{"postgres", "nats", "migrate", "relay"} {
		mustService(t, c, name)
	}
	for name, s := range c.Services {
		for dep := range dependsOn(t, name, s.DependsOn) {
			if _, ok := c.Services[dep]; !ok {
				t.Errorf("service %s depends on %q, which is not a service", name, dep)
			}
		}
		for target, src := range mounts(t, name, s.Volumes) {
			switch {
			case strings.HasPrefix(src, "/"):
				continue // a host path outside the repository
			case strings.HasPrefix(src, "."):
				if _, err := os.Stat(filepath.Join(root, src)); err != nil {
					t.Errorf("service %s mounts %s at %s: %v", name, src, target, err)
				}
				continue
			}
			if _, ok := c.Volumes[src]; !ok {
				t.Errorf("service %s mounts named volume %q, which is not declared under top-level volumes", name, src)
			}
		}
		if s.Image == "" && s.Build == nil {
			t.Errorf("service %s has neither image nor build", name)
		}
	}
}

func TestPostgres(t *testing.T) {
	c := loadCompose(t)
	pg := mustService(t, c, "postgres")
	if !strings.HasPrefix(pg.Image, "postgres:") {
		t.Errorf("postgres image = %q, want postgres:<version>", pg.Image)
	}
	cmd := stringList(t, "postgres command", pg.Command)
	settings := map[string]string{}
	for i, a := range cmd {
		if a == "-c" && i+1 < len(cmd) {
			k, v, _ := strings.Cut(cmd[i+1], "=")
			settings[k] = v
		}
	}
	if settings["wal_level"] != "logical" {
		t.Errorf("postgres command %q does not set -c wal_level=logical (the relay streams a logical replication slot)", cmd)
	}
	for _, k := range []string{"max_replication_slots", "max_wal_senders"} {
		if n, err := strconv.Atoi(settings[k]); err != nil || n < 1 {
			t.Errorf("postgres command %q: %s = %q, want a positive number", cmd, k, settings[k])
		}
	}
	env := envMap(t, "postgres", pg.Environment)
	if env["POSTGRES_PASSWORD"] == "" {
		t.Error("postgres: POSTGRES_PASSWORD is not set (the image refuses to start without it)")
	}
	if pg.Healthcheck == nil || !slices.Contains(stringList(t, "postgres healthcheck", pg.Healthcheck.Test), "pg_isready") {
		t.Error("postgres: want a healthcheck that runs pg_isready (migrate waits for service_healthy)")
	}
}

// natsService returns the nats service's command line and the host path of
// the config file it reads.
func natsService(t *testing.T, c compose) (args []string, hostConf string) {
	t.Helper()
	n := mustService(t, c, "nats")
	args = stringList(t, "nats command", n.Command)
	if !slices.Contains(args, "-js") && !slices.Contains(args, "--jetstream") {
		t.Errorf("nats command %q does not enable JetStream (-js)", args)
	}
	confPath, ok := flagValue(args, "-c", "--config")
	if !ok {
		t.Fatalf("nats command %q has no -c <config file>", args)
	}
	src, ok := mounts(t, "nats", n.Volumes)[confPath]
	if !ok {
		t.Fatalf("nats reads %s, but no volume is mounted there", confPath)
	}
	return args, filepath.Join(root, src)
}

func TestNATSConfigFile(t *testing.T) {
	c := loadCompose(t)
	_, hostConf := natsService(t, c)
	m, err := conf.ParseFile(hostConf)
	if err != nil {
		t.Fatalf("nats-server's parser rejects %s: %v", hostConf, err)
	}
	js, ok := m["jetstream"].(map[string]any)
	if !ok {
		t.Fatalf("%s: no jetstream block (got %T)", hostConf, m["jetstream"])
	}
	if v := fmt.Sprint(js["sync_interval"]); v != "always" {
		t.Errorf("%s: jetstream.sync_interval = %q, want always (fsync before ack: acked messages survive an OS crash)", hostConf, v)
	}
}

// TestNATSCommandLine runs the compose command line through nats-server's own
// option handling (which rejects, for example, store_dir both in the file and
// on the command line) and then starts that configuration in-process.
func TestNATSCommandLine(t *testing.T) {
	c := loadCompose(t)
	n := mustService(t, c, "nats")
	args, hostConf := natsService(t, c)
	confPath, _ := flagValue(args, "-c", "--config")
	local := slices.Clone(args)
	for i := range local {
		if local[i] == confPath {
			local[i] = hostConf
		}
	}
	fset := flag.NewFlagSet("nats-server", flag.ContinueOnError)
	noop := func() {}
	opts, err := server.ConfigureOptions(fset, local, noop, noop, noop)
	if err != nil {
		t.Fatalf("nats-server %s: %v", strings.Join(args, " "), err)
	}
	if !opts.JetStream {
		t.Error("JetStream is not enabled")
	}
	if !opts.SyncAlways {
		t.Error("JetStream sync_interval is not always")
	}
	if opts.StoreDir == "" {
		t.Error("no JetStream store directory: streams would land in a temporary directory and vanish with the container")
	} else if _, ok := mounts(t, "nats", n.Volumes)[opts.StoreDir]; !ok {
		t.Errorf("JetStream store directory %s is not a mounted volume: streams would vanish with the container", opts.StoreDir)
	}
	if n.Healthcheck == nil {
		t.Error("nats: want a healthcheck (relay waits for service_healthy)")
	} else {
		hc := stringList(t, "nats healthcheck", n.Healthcheck.Test)
		var hcURL *url.URL
		for _, a := range hc {
			if u, err := url.Parse(a); err == nil && u.Scheme == "http" {
				hcURL = u
			}
		}
		switch {
		case hcURL == nil:
			t.Errorf("nats healthcheck %q: no http:// URL", hc)
		case hcURL.Port() != strconv.Itoa(opts.HTTPPort):
			t.Errorf("nats healthcheck polls port %s, but the monitoring port is %d (-m)", hcURL.Port(), opts.HTTPPort)
		}
		if len(hc) > 1 && hc[0] == "CMD" && (hc[1] == "wget" || hc[1] == "curl") && !strings.Contains(n.Image, "alpine") {
			t.Errorf("nats healthcheck runs %s, but image %s is not the -alpine variant (the plain image has no shell tools)", hc[1], n.Image)
		}
	}

	// Start it, with the ports and the store directory made local.
	opts.StoreDir = t.TempDir()
	opts.Host, opts.Port = "127.0.0.1", -1
	opts.HTTPHost, opts.HTTPPort = "127.0.0.1", -1
	opts.NoLog, opts.NoSigs = true, true
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats-server with %s: %v", hostConf, err)
	}
	go s.Start()
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	if !s.ReadyForConnections(30 * time.Second) {
		t.Fatal("nats-server did not become ready")
	}
	if !s.JetStreamEnabled() {
		t.Fatal("JetStream is not enabled on the started server")
	}
	if cfg := s.JetStreamConfig(); cfg == nil || !cfg.SyncAlways {
		t.Errorf("started server's JetStream config %+v: want SyncAlways", cfg)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + s.MonitorAddr().String() + "/healthz")
	if err != nil {
		t.Fatalf("GET /healthz: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /healthz: %s", resp.Status)
	}
}

func TestNATSImageVersion(t *testing.T) {
	n := mustService(t, loadCompose(t), "nats")
	repo, tag, _ := strings.Cut(n.Image, ":")
	if repo != "nats" {
		t.Fatalf("nats image = %q, want nats:<version>", n.Image)
	}
	var major, minor int
	if _, err := fmt.Sscanf(tag, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("nats image tag %q: want a pinned major.minor version", tag)
	}
	// The relay is built and tested against the nats-server go.mod pins
	// (2.15); the JetStream features it uses are all in 2.12.
	if major < 2 || major == 2 && minor < 12 {
		t.Errorf("nats image %s: want 2.12 or newer", n.Image)
	}
	if !strings.HasSuffix(tag, "-alpine") {
		t.Errorf("nats image tag %q: want the -alpine variant (wget for the healthcheck)", tag)
	}
}

func buildContext(t *testing.T, what string, b any) string {
	t.Helper()
	switch b := b.(type) {
	case string:
		return b
	case map[string]any:
		if ctx, ok := b["context"].(string); ok {
			return ctx
		}
		return "."
	default:
		t.Fatalf("%s: build is a %T, want the repository (build: .)", what, b)
		return ""
	}
}

func TestMigrateAndRelay(t *testing.T) {
	c := loadCompose(t)
	pg := mustService(t, c, "postgres")
	pgEnv := envMap(t, "postgres", pg.Environment)
	wantUser := cmpOr(pgEnv["POSTGRES_USER"], "postgres")
	wantDB := cmpOr(pgEnv["POSTGRES_DB"], wantUser)

	checkDatabaseURL := func(svc, raw string) {
		t.Helper()
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
			t.Errorf("%s: OUTBOX_RELAY_DATABASE_URL = %q, want a postgres:// URL", svc, raw)
			return
		}
		if u.Hostname() != "postgres" || cmpOr(u.Port(), "5432") != "5432" {
			t.Errorf("%s: OUTBOX_RELAY_DATABASE_URL host %q, want the compose service postgres:5432", svc, u.Host)
		}
		pw, _ := u.User.Password()
		if u.User.Username() != wantUser || pw != pgEnv["POSTGRES_PASSWORD"] {
			t.Errorf("%s: OUTBOX_RELAY_DATABASE_URL user/password do not match the postgres service's POSTGRES_USER/POSTGRES_PASSWORD", svc)
		}
		if db := strings.TrimPrefix(u.Path, "/"); db != wantDB {
			t.Errorf("%s: OUTBOX_RELAY_DATABASE_URL database %q, want %q (POSTGRES_DB)", svc, db, wantDB)
		}
	}

	mig := mustService(t, c, "migrate")
	if ctx := buildContext(t, "migrate", mig.Build); path.Clean(ctx) != "." {
		t.Errorf("migrate: build context %q, want the repository root", ctx)
	}
	if cmd := stringList(t, "migrate command", mig.Command); len(cmd) == 0 || cmd[0] != "migrate" {
		t.Errorf("migrate: command %q, want [migrate]", cmd)
	}
	checkDatabaseURL("migrate", envMap(t, "migrate", mig.Environment)["OUTBOX_RELAY_DATABASE_URL"])
	if cond := dependsOn(t, "migrate", mig.DependsOn)["postgres"]; cond != "service_healthy" {
		t.Errorf("migrate: depends_on postgres condition %q, want service_healthy", cond)
	}
	if mig.Restart != "no" {
		t.Errorf(`migrate: restart %q, want "no" (it runs once and exits)`, mig.Restart)
	}

	relay := mustService(t, c, "relay")
	if ctx := buildContext(t, "relay", relay.Build); path.Clean(ctx) != "." {
		t.Errorf("relay: build context %q, want the repository root", ctx)
	}
	if cmd := stringList(t, "relay command", relay.Command); len(cmd) == 0 || cmd[0] != "run" {
		t.Errorf("relay: command %q, want [run]", cmd)
	}
	env := envMap(t, "relay", relay.Environment)
	checkDatabaseURL("relay", env["OUTBOX_RELAY_DATABASE_URL"])

	natsPort := "4222"
	if p, ok := flagValue(stringList(t, "nats command", mustService(t, c, "nats").Command), "-p", "--port"); ok {
		natsPort = p
	}
	if u, err := url.Parse(env["OUTBOX_RELAY_NATS_URL"]); err != nil || u.Scheme != "nats" || u.Hostname() != "nats" || cmpOr(u.Port(), "4222") != natsPort {
		t.Errorf("relay: OUTBOX_RELAY_NATS_URL = %q, want nats://nats:%s (the compose service)", env["OUTBOX_RELAY_NATS_URL"], natsPort)
	}

	deps := dependsOn(t, "relay", relay.DependsOn)
	if deps["migrate"] != "service_completed_successfully" {
		t.Errorf("relay: depends_on migrate condition %q, want service_completed_successfully", deps["migrate"])
	}
	if deps["nats"] != "service_healthy" {
		t.Errorf("relay: depends_on nats condition %q, want service_healthy", deps["nats"])
	}

	if addr, ok := env["OUTBOX_RELAY_HTTP_ADDR"]; ok {
		_, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatalf("relay: OUTBOX_RELAY_HTTP_ADDR = %q: %v", addr, err)
		}
		p, _ := strconv.Atoi(port)
		if !slices.Contains(containerPorts(t, "relay", relay.Ports), p) {
			t.Errorf("relay serves HTTP on %s but does not publish container port %d", addr, p)
		}
		if exposed := parseDockerfile(t).final().args("EXPOSE"); !slices.Contains(exposed, port) {
			t.Errorf("relay serves HTTP on %s but the Dockerfile's final stage exposes %q", addr, exposed)
		}
	}
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// TestEnvironmentNamesFlags checks that every OUTBOX_RELAY_* variable the
// compose file sets is the variable of a flag the binary defines (a typo is
// otherwise silently ignored).
func TestEnvironmentNamesFlags(t *testing.T) {
	c := loadCompose(t)
	flags := flagNames(t, filepath.Join(root, "cmd"), filepath.Join(root, "internal"))
	for name, s := range c.Services {
		for k := range envMap(t, name, s.Environment) {
			rest, ok := strings.CutPrefix(k, "OUTBOX_RELAY_")
			if !ok {
				continue
			}
			flagName := strings.ToLower(strings.ReplaceAll(rest, "_", "-"))
			if !flags[flagName] {
				t.Errorf("service %s sets %s, but no flag --%s exists", name, k, flagName)
			}
		}
	}
}

// flagNames collects the names of flags registered through flag.FlagSet-like
// calls (fs.StringVar(&v, "name", ...), fs.Duration("name", ...), ...) in the
// non-test Go files under dirs.
func flagNames(t *testing.T, dirs ...string) map[string]bool {
	t.Helper()
	nameArg := map[string]int{
		"StringVar": 1, "IntVar": 1, "Int64Var": 1, "UintVar": 1, "Uint64Var": 1, "BoolVar": 1,
		"DurationVar": 1, "Float64Var": 1, "TextVar": 1, "Var": 1,
		"String": 0, "Int": 0, "Int64": 0, "Uint": 0, "Uint64": 0, "Bool": 0,
		"Duration": 0, "Float64": 0, "Func": 0, "BoolFunc": 0,
	}
	out := map[string]bool{}
	fset := token.NewFileSet()
	consts := stringConsts(t, fset, dirs...)
	walkGoFiles(t, fset, dirs, func(n ast.Node) {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return
		}
		i, ok := nameArg[sel.Sel.Name]
		if !ok || i >= len(call.Args) {
			return
		}
		switch arg := call.Args[i].(type) {
		case *ast.BasicLit:
			if s, err := strconv.Unquote(arg.Value); err == nil && arg.Kind == token.STRING {
				out[s] = true
			}
		case *ast.Ident:
			// A name kept in a constant (flagDatabaseURL = "database-url").
			if s, ok := consts[arg.Name]; ok {
				out[s] = true
			}
		}
	})
	if len(out) == 0 {
		t.Fatal("found no flag definitions under cmd/ and internal/")
	}
	return out
}

// stringConsts collects the string constants declared in the non-test Go
// files under dirs, by name.
func stringConsts(t *testing.T, fset *token.FileSet, dirs ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	walkGoFiles(t, fset, dirs, func(n ast.Node) {
		vs, ok := n.(*ast.ValueSpec)
		if !ok {
			return
		}
		for k, name := range vs.Names {
			if k >= len(vs.Values) {
				break
			}
			if lit, ok := vs.Values[k].(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil {
					out[name.Name] = s
				}
			}
		}
	})
	return out
}

// walkGoFiles calls visit on every node of the non-test Go files under dirs.
func walkGoFiles(t *testing.T, fset *token.FileSet, dirs []string, visit func(ast.Node)) {
	t.Helper()
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			ast.Inspect(f, func(n ast.Node) bool {
				visit(n)
				return true
			})
			return nil
		})
		if err != nil {
			t.Fatalf("scan %s: %v", dir, err)
		}
	}
}

// dockerfile is a parsed Dockerfile: its stages in order.
type dockerfile struct{ stages []stage }

type stage struct {
	from, name string
	instrs     []instr
}

type instr struct{ cmd, rest string }

func (d dockerfile) final() stage { return d.stages[len(d.stages)-1] }

// args returns the whitespace-separated arguments of every instruction cmd.
func (s stage) args(cmd string) []string {
	var out []string
	for _, in := range s.instrs {
		if in.cmd == cmd {
			out = append(out, strings.Fields(in.rest)...)
		}
	}
	return out
}

func parseDockerfile(t *testing.T) dockerfile {
	t.Helper()
	f, err := os.Open(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatalf("open Dockerfile: %v", err)
	}
	defer f.Close()
	var (
		d       dockerfile
		pending string
	)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && pending == "") {
			continue
		}
		if cont, ok := strings.CutSuffix(line, `\`); ok {
			pending += cont + " "
			continue
		}
		line = pending + line
		pending = ""
		cmd, rest, _ := strings.Cut(line, " ")
		cmd = strings.ToUpper(cmd)
		rest = strings.TrimSpace(rest)
		if cmd == "FROM" {
			fields := strings.Fields(rest)
			st := stage{}
			for i := 0; i < len(fields); i++ {
				switch {
				case strings.HasPrefix(fields[i], "--"):
				case strings.EqualFold(fields[i], "AS") && i+1 < len(fields):
					st.name = fields[i+1]
					i++
				default:
					st.from = fields[i]
				}
			}
			d.stages = append(d.stages, st)
			continue
		}
		if len(d.stages) == 0 {
			continue // ARG before the first FROM
		}
		last := &d.stages[len(d.stages)-1]
		last.instrs = append(last.instrs, instr{cmd, rest})
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read Dockerfile: %v", err)
	}
	if len(d.stages) == 0 {
		t.Fatal("Dockerfile has no FROM")
	}
	return d
}

func TestDockerfile(t *testing.T) {
	d := parseDockerfile(t)
	if len(d.stages) < 2 {
		t.Fatalf("Dockerfile has %d stage(s), want a build stage and a small final stage", len(d.stages))
	}

	// The build stage: a static build of ./cmd/outbox-relay.
	built := false
	for _, st := range d.stages[:len(d.stages)-1] {
		envCGO0 := false
		for _, in := range st.instrs {
			if in.cmd == "ENV" && (strings.Contains(in.rest, "CGO_ENABLED=0") || slices.Equal(strings.Fields(in.rest), []string{"CGO_ENABLED", "0"})) {
				envCGO0 = true
			}
			if in.cmd != "RUN" || !strings.Contains(in.rest, "go build") || !strings.Contains(in.rest, "./cmd/outbox-relay") {
				continue
			}
			built = true
			if !envCGO0 && !strings.Contains(in.rest, "CGO_ENABLED=0") {
				t.Errorf("Dockerfile builds ./cmd/outbox-relay without CGO_ENABLED=0: the final image has no C library")
			}
			if !strings.Contains(in.rest, "-X main.version=") {
				t.Errorf("Dockerfile build does not set main.version (-ldflags -X main.version=...)")
			}
		}
	}
	if !built {
		t.Error("no build stage runs go build ... ./cmd/outbox-relay")
	}
	if !hasVersionVar(t) {
		t.Error("cmd/outbox-relay has no package-level string var version for -X main.version to set")
	}

	final := d.final()
	users := final.args("USER")
	if len(users) == 0 {
		t.Fatal("the Dockerfile's final stage has no USER: the relay would run as root")
	}
	u, _, _ := strings.Cut(users[len(users)-1], ":")
	if u == "root" || u == "0" {
		t.Errorf("the Dockerfile's final stage runs as %q, want a non-root user", u)
	}
	ep := strings.Join(final.args("ENTRYPOINT"), " ")
	if !strings.Contains(ep, "/outbox-relay") {
		t.Errorf("final stage ENTRYPOINT %q does not run /outbox-relay", ep)
	}
	copied := false
	for _, in := range final.instrs {
		if in.cmd == "COPY" && strings.Contains(in.rest, "--from=") && strings.Contains(in.rest, "/outbox-relay") {
			copied = true
		}
	}
	if !copied {
		t.Error("final stage does not COPY --from=<build stage> the outbox-relay binary")
	}
}

func hasVersionVar(t *testing.T) bool {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(root, "cmd", "outbox-relay", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range files {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("parse %s: %v", p, err)
		}
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, n := range vs.Names {
					if n.Name != "version" {
						continue
					}
					if id, ok := vs.Type.(*ast.Ident); ok && id.Name == "string" {
						return true
					}
					if i < len(vs.Values) {
						if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
							return true
						}
					}
				}
			}
		}
	}
	return false
}

// TestDockerignore checks that the build context keeps what go build needs.
func TestDockerignore(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root, ".dockerignore"))
	if err != nil {
		t.Fatalf("read .dockerignore: %v", err)
	}
	var patterns []string
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") || strings.HasPrefix(line, "!") {
			continue
		}
		patterns = append(patterns, strings.TrimPrefix(path.Clean(line), "/"))
	}
	if !slices.Contains(patterns, ".git") {
		t.Error(".dockerignore does not exclude .git")
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		name := e.Name()
		needed := name == "go.mod" || name == "go.sum"
		if e.IsDir() && !strings.HasPrefix(name, ".") {
			_ = filepath.WalkDir(filepath.Join(root, name), func(p string, d fs.DirEntry, err error) error {
				if err == nil && !d.IsDir() && strings.HasSuffix(p, ".go") {
					needed = true
					return fs.SkipAll
				}
				return nil
			})
		}
		if !needed {
			continue
		}
		for _, p := range patterns {
			if ok, _ := path.Match(p, name); ok {
				t.Errorf(".dockerignore pattern %q excludes %s, which the build needs", p, name)
			}
		}
	}
}
