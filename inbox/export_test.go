package inbox

// SetAfterCommit installs a hook that runs between the commit and the ack.
func SetAfterCommit(in *Inbox, f func()) { in.afterCommit = f }
