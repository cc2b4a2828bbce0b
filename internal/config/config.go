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
	"strings"
	"time"

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

// Usage writes a subcommand's help: what it does, then every flag with its
// default and its environment variable.
func Usage(fs *flag.FlagSet, w io.Writer, summary string) func() {
	return func() {
		fmt.Fprintf(w, "%s\n\nFlags (each also read from its environment variable):\n", summary)
		fs.VisitAll(func(f *flag.Flag) {
			def := ""
			if f.DefValue != "" {
				def = fmt.Sprintf(" (default %s)", f.DefValue)
			}
			fmt.Fprintf(w, "  --%s%s  [%s]\n      %s\n", f.Name, def, EnvName(f.Name), f.Usage)
		})
	}
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
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339}
	default:
		return zerolog.Nop(), fmt.Errorf("--log-format %q: want json or console", l.Format)
	}
	zerolog.TimeFieldFormat = time.RFC3339Nano
	return zerolog.New(w).Level(level).With().Timestamp().Logger(), nil
}

// Stderr is where logs go.
var Stderr io.Writer = os.Stderr

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
