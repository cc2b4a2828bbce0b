package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func runVersion(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("version", "Prints the version.", stderr)
	c.register(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	v := version
	if bi, ok := debug.ReadBuildInfo(); ok && v == "dev" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		v = bi.Main.Version
	}
	fmt.Fprintf(stdout, "outbox-relay %s\n", v)
	return nil
}
