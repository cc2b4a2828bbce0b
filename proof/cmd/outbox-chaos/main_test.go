package main

import "testing"

func TestReplayCommand(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-duration", "75s", "-max-gap", "2s"}, "cd proof && go run ./cmd/outbox-chaos -duration 75s -max-gap 2s -seed 42"},
		{[]string{"-seed", "7", "-failover"}, "cd proof && go run ./cmd/outbox-chaos -failover -seed 42"},
		{[]string{"--seed=7", "-json", "/tmp/a b.json"}, "cd proof && go run ./cmd/outbox-chaos -json '/tmp/a b.json' -seed 42"},
		{nil, "cd proof && go run ./cmd/outbox-chaos -seed 42"},
	} {
		if got := replayCommand(c.args, 42); got != c.want {
			t.Errorf("replayCommand(%q) = %q, want %q", c.args, got, c.want)
		}
	}
}
