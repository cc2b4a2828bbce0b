// Package config binds command-line flags to OUTBOX_RELAY_* environment
// variables and builds the logger. A flag given on the command line wins over
// its variable; a variable wins over the default.
package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/rs/zerolog"
)

// EnvName is the variable that sets flag name: OUTBOX_RELAY_ + upper case,
// '-' as '_'.
func EnvName(flagName string) string {
	return "OUTBOX_RELAY_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Parse parses args into fs, then fills every flag not given on the command
// line from its environment variable. A bad value names both the variable
// and the flag.
func Parse(fs *flag.FlagSet, args []string, lookup func(string) (string, bool)) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q (flags go before it? see --help)", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] {
			return
		}
		env := EnvName(f.Name)
		v, ok := lookup(env)
		if !ok {
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: invalid value for --%s: %w", env, v, f.Name, err))
		}
	})
	return errors.Join(errs...)
}

// Groups sorts a command's flags under headings in its --help: Of names a
// flag's heading, Order lists the headings (one not listed comes last).
type Groups struct {
	Order []string
	Of    func(flag string) string
	// Rank orders a heading's flags (lower first; equal ranks stay in
	// alphabetical order); nil: alphabetical.
	Rank func(flag string) int
}

// Usage writes a subcommand's help: what it does, then every flag with its
// default and its environment variable, under the headings of groups (none:
// one list), and which flags the command ignores (see Ignore).
func Usage(fs *flag.FlagSet, w io.Writer, summary string, groups Groups) func() {
	return func() {
		fmt.Fprintf(w, "%s\n\nFlags (each also read from its environment variable):\n", summary)
		byGroup := map[string][]*flag.Flag{}
		var order []string
		fs.VisitAll(func(f *flag.Flag) {
			g := ""
			if groups.Of != nil {
				g = groups.Of(f.Name)
			}
			if _, seen := byGroup[g]; !seen && !slices.Contains(groups.Order, g) {
				order = append(order, g)
			}
			byGroup[g] = append(byGroup[g], f)
		})
		anyIgnored := false
		for _, g := range append(slices.Clone(groups.Order), order...) {
			flags := byGroup[g]
			if len(flags) == 0 {
				continue
			}
			if groups.Rank != nil {
				slices.SortStableFunc(flags, func(a, b *flag.Flag) int { return groups.Rank(a.Name) - groups.Rank(b.Name) })
			}
			if g != "" {
				fmt.Fprintf(w, "\n%s:\n", g)
			}
			for _, f := range flags {
				def := ""
				if f.DefValue != "" {
					def = fmt.Sprintf(" (default %s)", f.DefValue)
				}
				mark := ""
				if Ignored(f) {
					mark, anyIgnored = "  (ignored by "+fs.Name()+")", true
				}
				fmt.Fprintf(w, "  --%s%s  [%s]%s\n      %s\n", f.Name, def, EnvName(f.Name), mark, f.Usage)
			}
		}
		if anyIgnored {
			fmt.Fprintf(w, "\nThe flags marked ignored are accepted, and their values not checked, so that one set of\nflags or one environment file serves every command.\n")
		}
	}
}

// Ignore marks flags of fs that the command accepts but does not read. A
// deployment passes one set of flags (or one environment file) to every
// command, so refusing them ("flag provided but not defined") would break it;
// marking them lets --help say which ones make no difference.
func Ignore(fs *flag.FlagSet, names ...string) {
	for _, name := range names {
		f := fs.Lookup(name)
		if f == nil {
			panic("config.Ignore: no flag --" + name)
		}
		if !Ignored(f) {
			f.Value = ignored{f.Value}
		}
	}
}

// Ignored reports whether Ignore marked f.
func Ignored(f *flag.Flag) bool {
	_, ok := f.Value.(ignored)
	return ok
}

// ignored wraps an ignored flag's value: the mark travels with the flag, so
// Usage needs no other record of it.
type ignored struct{ flag.Value }

// IsBoolFlag keeps `--flag` without a value working for an ignored boolean.
func (v ignored) IsBoolFlag() bool {
	b, ok := v.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// Logging holds the logging flags.
type Logging struct {
	Level  string
	Format string
}

// Register adds --log-level and --log-format.
func (l *Logging) Register(fs *flag.FlagSet) {
	fs.StringVar(&l.Level, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&l.Format, "log-format", "json", "json (for machines) or console (for people)")
}

// Logger builds the process's one logger.
func (l *Logging) Logger(w io.Writer) (zerolog.Logger, error) {
	level, err := zerolog.ParseLevel(l.Level)
	if err != nil || l.Level == "" {
		return zerolog.Nop(), fmt.Errorf("--log-level %q: want debug, info, warn or error", l.Level)
	}
	switch l.Format {
	case "json":
	case "console":
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339, NoColor: !colour(w, os.LookupEnv)}
	default:
		return zerolog.Nop(), fmt.Errorf("--log-format %q: want json or console", l.Format)
	}
	setTimeFormat()
	return zerolog.New(w).Level(level).With().Timestamp().Logger(), nil
}

// setTimeFormat sets zerolog's process-wide time format once: a second
// command run in the same process (tests run two relays side by side)
// would otherwise write it while the first one's goroutines read it.
var setTimeFormat = sync.OnceFunc(func() { zerolog.TimeFieldFormat = time.RFC3339Nano })

// colour reports whether console output to w may carry ANSI colour codes:
// only on a terminal, where they render, and not when NO_COLOR is set to
// anything (https://no-color.org). In a file or a pipe they are noise that
// grep and log shippers trip over.
func colour(w io.Writer, lookup func(string) (string, bool)) bool {
	if v, ok := lookup("NO_COLOR"); ok && v != "" {
		return false
	}
	f, ok := w.(*os.File)
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}

// List is a repeatable flag whose every value may also hold several
// comma-separated items, so `--x a --x b`, `--x a,b` and the environment
// variable's `a,b` all mean the same.
type List []string

// String implements flag.Value.
func (l *List) String() string { return strings.Join(*l, ",") }

// Set implements flag.Value: it appends, skipping empty items.
func (l *List) Set(v string) error {
	for _, item := range strings.Split(v, ",") {
		if item = strings.TrimSpace(item); item != "" {
			*l = append(*l, item)
		}
	}
	return nil
}
