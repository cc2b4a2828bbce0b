package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var updateReference = flag.Bool("update", false, "rewrite docs/configuration.md from the commands' flags")

// helpFlag is one flag as a command's --help lists it.
type helpFlag struct {
	name, def, env, usage, group string
	ignored                      bool
}

var helpLine = regexp.MustCompile(`^  --([a-z0-9-]+)(?: \(default (.*)\))?  \[([A-Z0-9_]+)\](  \(ignored by [a-z]+\))?$`)

// helpOf runs a command's --help and reads its flags back, with headings.
func helpOf(t *testing.T, command string) (summary string, flags []helpFlag) {
	t.Helper()
	var out, errOut strings.Builder
	if code := mainErr([]string{command, "--help"}, &out, &errOut); code != 0 {
		t.Fatalf("%s --help exited %d", command, code)
	}
	lines := strings.Split(errOut.String(), "\n")
	group := ""
	inFlags := false
	var sum []string
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		switch {
		case strings.HasPrefix(l, "Flags (each also read"):
			inFlags = true
		case !inFlags:
			if !strings.HasPrefix(l, "usage:") {
				sum = append(sum, l)
			}
		case strings.HasSuffix(l, ":") && !strings.HasPrefix(l, " "):
			group = strings.TrimSuffix(l, ":")
		case strings.HasPrefix(l, "  --"):
			m := helpLine.FindStringSubmatch(l)
			if m == nil || i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "      ") {
				t.Fatalf("%s --help: cannot read the flag line %q", command, l)
			}
			flags = append(flags, helpFlag{name: m[1], def: m[2], env: m[3], ignored: m[4] != "", group: group, usage: strings.TrimSpace(lines[i+1])})
			i++
		}
	}
	return strings.TrimSpace(strings.Join(sum, "\n")), flags
}

// machineDefault replaces a default that depends on where --help ran.
func machineDefault(name, def string) string {
	switch name {
	case "worker-id":
		return "<hostname>-<pid>"
	case "by":
		return "$USER@<hostname>"
	}
	return def
}

func mdCell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ", "<", "&lt;", ">", "&gt;").Replace(s)
}

func renderReference(t *testing.T) string {
	var b strings.Builder
	b.WriteString(`# Configuration reference

Every setting of every command: its flag, the environment variable it is also read from (a flag
given on the command line wins), its default, the values the command accepts, what it does and
which guarantees of [guarantees.md](guarantees.md) depend on it. The common flags (the
connections, the names of the table, slot and stream, logging) mean the same in every command, so
one set of flags or one environment file serves them all; a command accepts the common flags it
does not read and ignores them.

This page is generated from the binary's own flags (` + "`go test ./cmd/outbox-relay -run TestConfigurationReference -update`" + `);
the test fails when it differs from what the commands say. Other pages link here rather than repeat
a flag's meaning.

`)
	names := make([]string, 0, len(commands()))
	for _, c := range commands() {
		names = append(names, c.name)
	}
	b.WriteString("Commands: " + strings.Join(func() []string {
		var l []string
		for _, n := range names {
			l = append(l, "["+n+"](#"+n+")")
		}
		return l
	}(), ", ") + ".\n")
	for _, name := range names {
		summary, flags := helpOf(t, name)
		fmt.Fprintf(&b, "\n## %s\n\n%s\n", name, summary)
		var ignored, common []string
		group := ""
		for _, f := range flags {
			if f.ignored {
				ignored = append(ignored, "`--"+f.name+"`")
				continue
			}
			if name != "run" && isCommon(f.name) {
				common = append(common, "`--"+f.name+"`")
				continue
			}
			if f.group != group {
				group = f.group
				fmt.Fprintf(&b, "\n### %s: %s\n\n| flag | variable | default | accepts | serves | what it does |\n| --- | --- | --- | --- | --- | --- |\n", name, group)
			}
			s := settings[f.name]
			if name != "run" && !isCommon(f.name) {
				s = setting{}
			}
			def := machineDefault(f.name, f.def)
			if def != "" {
				def = "`" + def + "`"
			}
			fmt.Fprintf(&b, "| `--%s` | `%s` | %s | %s | %s | %s |\n", f.name, f.env, mdCell(def), mdCell(s.limits), s.serves, mdCell(f.usage))
		}
		if len(common) > 0 {
			fmt.Fprintf(&b, "\nReads the common flags %s, as [run](#run) describes them.\n", strings.Join(common, ", "))
		}
		if len(ignored) > 0 {
			fmt.Fprintf(&b, "\nAccepts and ignores %s.\n", strings.Join(ignored, ", "))
		}
	}
	return b.String()
}

// docs/configuration.md is what the commands' --help says, and every flag
// of run has its heading and reference entry.
func TestConfigurationReference(t *testing.T) {
	got := renderReference(t)
	path := filepath.Join("..", "..", "docs", "configuration.md")
	if *updateReference {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(want) != got {
		t.Fatalf("docs/configuration.md is not what the commands say: run go test ./cmd/outbox-relay -run TestConfigurationReference -update (and read the diff)")
	}
}

// Every flag of run has a heading in settingList, and every entry names a
// flag of run: a new flag is placed, a removed one leaves no entry behind.
func TestEveryRunFlagHasASetting(t *testing.T) {
	_, flags := helpOf(t, "run")
	var names []string
	for _, f := range flags {
		names = append(names, f.name)
		if _, ok := settings[f.name]; !ok {
			t.Errorf("run --%s has no entry in settingList (settings.go): give it a heading", f.name)
		}
	}
	for _, s := range settingList {
		if !slices.Contains(names, s.name) {
			t.Errorf("settingList names --%s, which run does not have", s.name)
		}
		if s.refused != "" && s.limits == "" {
			t.Errorf("--%s: a refused value without the limits it is outside", s.name)
		}
	}
}

// --help is for people: no design IDs (G12) in it; the reference says
// which guarantees a setting serves.
func TestHelpHasNoDesignIDs(t *testing.T) {
	id := regexp.MustCompile(`\bG[0-9]+\b`)
	for _, c := range commands() {
		_, flags := helpOf(t, c.name)
		for _, f := range flags {
			if id.MatchString(f.usage) {
				t.Errorf("%s --%s: a design ID in --help: %q", c.name, f.name, f.usage)
			}
		}
	}
}

// The limits the reference states are the ones run enforces: each setting's
// refused value is refused before anything connects, naming the flag.
func TestRunSettingLimits(t *testing.T) {
	for _, s := range settingList {
		if s.refused == "" {
			continue
		}
		code, _, errOut := run(t, "run", "--database-url", "postgres://127.0.0.1:1/none?connect_timeout=1", "--nats-url", "nats://127.0.0.1:1",
			"--"+s.name, s.refused)
		if code == 0 || !strings.Contains(errOut, "--"+s.name) {
			t.Errorf("run --%s %s (outside %q) exited %d, stderr %q: want it refused, naming the flag", s.name, s.refused, s.limits, code, errOut)
		}
	}
}
