package replication

import "net"

// IsDrainConn reports whether c is a socket the stream drains without
// waiting (for the package's external tests).
func IsDrainConn(c net.Conn) bool {
	_, ok := c.(*drainConn)
	return ok
}
